"""
prompts.py: what the policy is told. The transcript structure's system prompt (its KBs from
dataio.KB_TABLE) with the last-step note and Agentic RAG-R1's actions note, and R1-Router's released
prompts (--structure released), verbatim, a KB added to dataio.KB_TABLE joining their retriever
lists. rollout.py's step structures put them in the chats.
"""
from dataio import KB_TABLE

RETRIEVERS = [kb.retriever for kb in KB_TABLE]
SYSTEM_PROMPT = (
    "Answer the question step by step. Each step: <think>reasoning</think><sub-question>one simple "
    "question</sub-question><ret>"
    f"{', '.join(RETRIEVERS[:-1])} or {RETRIEVERS[-1]}</ret> "
    f"({'; '.join(kb.about for kb in KB_TABLE)}). After the evidence: <think>reasoning"
    "</think><answer>the answer</answer>. When you can answer, write <think>reasoning</think>"
    "<sub-question>None</sub-question><ret>None</ret>, then <think>reasoning</think><answer>the "
    "short final answer</answer>. "
    "Use at most {max_steps} sub-questions."
)
LAST_STEP_NOTE = "No more sub-questions are allowed; give the final answer."
ACTIONS_NOTE = (" If the last step's evidence does not answer its sub-question, write "
                "<think>reasoning</think><backtrack>why</backtrack> instead of the next "
                "sub-question: that step leaves the context. To keep a long context short, write "
                "<think>reasoning</think><summary>the facts found so far</summary>: it replaces "
                "the steps so far. At most {max_actions} of these.")

def with_new_kbs(prompt):
    """A released prompt names the three KBs: a KB added as a row of dataio.KB_TABLE joins its
    retriever list and its guidelines (the prompt's own text unchanged, so with the three it is
    verbatim)."""
    new = [kb for kb in KB_TABLE if kb.name not in ("text", "table", "image")]
    listed = "Text Image Retriever, Table Retriever"
    prompt = prompt.replace(listed + ".", listed + "".join(", " + kb.retriever for kb in new) + ".")
    last = '(e.g., "GDP of Japan in 2020")\n'
    return prompt.replace(last, last + "".join(f"   - `{kb.retriever}`:\n     - For {kb.about}\n"
                                               for kb in new))

# --structure released: R1-Router's released inference code (src/prompt.py and
# src/answer_generation.py of ChloeTT-LAO/Router-Search), where every step is its own single-turn
# chat with one of these system prompts, verbatim (typos and the answer prompts' stray leading quote
# included); the routing prompt as given to the trained model
RELEASED_ROUTE_PROMPT = with_new_kbs("""You are a professional question decomposition expert for \
multi-hop QA systems. Your task is to decompose complex questions into **strictly single-hop** \
sub-questions and select appropriate retrievers.

**Strict Output Format:**
<think>
[Analyze the original question and determine the next required sub-question. Do NOT reveal answers \
or perform multi-hop reasoning.]
</think>
<sub-question>
[Exactly ONE single-hop question one time. If no further information is needed to answer the \
origin question, write 'None'.]
</sub-question>
<ret> 
[Choose 1 retriever from: Text Retriever, Text Image Retriever, Table Retriever. Write 'None' if \
<sub-question> is 'None'.]
</ret>

### Critical Rules:
1. **Atomic Sub-question Definition**:
   - A sub-question is "atomic" only if: 
     a) It cannot be further decomposed into simpler questions
     b) It requires exactly **one retrieval action** to answer
     c) Does NOT depend on answers to previous sub-questions
     d) It can be helpful to answer the origin question
   - Example: \u274c "Find the capital and population of France" \u2192 \u2705 Split into two \
sub-questions

2. **Retriever Selection Guidelines**:
   - `Text Retriever`: 
     - For non-visual commonsense knowledge (e.g., "Define photosynthesis")
   - `Text Image Retriever`:
     - When sub-question explicitly references visual elements \
(e.g., "Describe the painting style of...")
   - `Table Retriever`:
     - For numerical/statistical queries (e.g., "GDP of Japan in 2020")

3. **Strict Prohibitions**:
   - Never combine multiple questions in <sub-question>
   - Never mention retrieved content in <think>
   - Never select retrievers for non-atomic questions


""")
RELEASED_ANSWER_PROMPT = """"You are a professional question answering model. Your task is to \
carefully think through the question based on the information retrieved and then provide the final \
answer.

Strict Output Format: 
<think> 
[Analyze the original question and the retrieved information. Break down the reasoning process \
step by step. Do NOT provide the final answer yet.] 
</think> 
<answer> 
[Provide the final answer based solely on the retrieved information.]
</answer>
"""
RELEASED_FINAL_PROMPT = """"You are a professional question answering model. Your task is to \
carefully think through the question based on the sub-quetsions and its answers and then provide \
the final answer.

Strict Output Format: 
<think> 
[Analyze the original question and sub-questions with its answers. Break down the reasoning \
process step by step. Do NOT provide the final answer yet.] 
</think> 
<answer> 
[Provide the final answer based solely on the information before.]
</answer>
"""
# the released evaluation's reminder after a third malformed routing step (answer_generation.py),
# verbatim
RELEASED_REMINDER = with_new_kbs("""**You dont give me the answer with the correct format, please \
follow the Strict Output Format:
                            <Thought>
                            [Analyze the original question and determine the next required \
sub-question. Do NOT reveal answers or perform multi-hop reasoning.]
                            <Sub-question>
                            [Exactly ONE single-hop question. If no retrieval is needed, write \
'None'.]
                            <Ret> 
                            [Choose 1 retriever from: Text Retriever, Text Image Retriever, Table \
Retriever. Write 'None' if <Sub-question> is 'None'.]
                            """)
