"""
vision.py: how a vision-language policy sees a picture. `VisionIO` wraps a model folder's
AutoProcessor: the token expansion of an image in a chat turn (what the trainer sees), the bare
placeholder plus the picture that vLLM takes instead, and the pixel inputs of a batch.
`VisionIO.load` returns None for a text-only policy, and every caller then leaves images out. Used
by transcript.py (chat turns with images) and engines.py (prompts with images).
"""
import socket
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

@dataclass(frozen=True)
class Img:
    path: str  # an image part of a chat turn (a file; its tokens come from VisionIO.expand)

class VisionIO:
    """A vision-language model's image plumbing, through the generic AutoProcessor API only
    (Idefics3/SmolVLM here, Qwen2.5-VL / Qwen3-VL on GPU). A chat turn's image is written as the
    placeholder its chat template renders for an image part (Idefics3: <image>; Qwen:
    <|vision_start|><|image_pad|><|vision_end|>); the transcript holds the processor's expansion of
    it (the tokens the model attends to, what the trainer sees), and vLLM gets the bare placeholder
    back with the picture in multi_modal_data, which it expands the same way (tested)."""
    CACHE = 256  # decoded pictures (full-size RGB) and token expansions kept, least recently used
                 # first out: a run over an image KB would otherwise hold every picture it ever saw
                 # in host memory

    def __init__(self, model_dir, max_pixels=None):
        """max_pixels: the processor's cap on a picture's pixels (Qwen2.5-VL: tokens = pixels /
        28^2, and its default cap, 12.8M pixels, allows 16k tokens, more than a 4k context), None:
        the processor's own; a processor without such a cap (Idefics3) ignores it."""
        import inspect
        from transformers import AutoConfig, AutoProcessor
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
        self.proc = AutoProcessor.from_pretrained(model_dir, **({"max_pixels": max_pixels}
                                                                if max_pixels else {}))
        self.tok = self.proc.tokenizer
        # a model with multimodal RoPE (Qwen2.5-VL, Qwen3-VL) places image tokens on a 3-D position
        # grid, which its forward builds from mm_token_type_ids; 1-D position ids (a packed group's)
        # would not match the engine's
        forward = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[
            type(AutoConfig.from_pretrained(model_dir))].forward
        self.mrope = "mm_token_type_ids" in inspect.signature(forward).parameters
        self.image_token_id = self.tok.convert_tokens_to_ids(self.proc.image_token)
        part = [{"type": "text", "text": "\x01"}, {"type": "image"},
                {"type": "text", "text": "\x02"}]
        text = self.proc.apply_chat_template([dict(role="user", content=part)], tokenize=False)
        self.placeholder = text[text.index("\x01") + 1:text.index("\x02")]
        self.placeholder_ids = self.tok.encode(self.placeholder, add_special_tokens=False)
        # path -> token ids, path -> PIL image (LRU)
        self._expanded, self._pixels = OrderedDict(), OrderedDict()
        self._dummy = None  # pixel inputs of the dummy picture (pixels(always=True)), made once
        # tokens only an image expansion holds: never sampled (the engines suppress them), skipped
        # when reading text
        special = {i for i, t in self.tok.added_tokens_decoder.items() if t.special}
        self.special_ids = sorted(set(self.expand(None)) & special)

    @staticmethod
    def load(model_dir, max_pixels=None):
        """VisionIO for a model folder whose config has a vision tower, else None (a text-only
        policy)."""
        return VisionIO(model_dir, max_pixels) if has_vision(model_dir) else None

    def image(self, path):
        """The RGB picture of a file (None: a 224 x 224 white square, R1-Router's dummy image)."""
        from PIL import Image
        if path is None:
            return Image.new("RGB", (224, 224), "white")
        # e.g. a retrieval server's folder this node lacks
        if path not in self._pixels and not Path(path).is_file():
            sys.exit(f"error: image file not found on {socket.gethostname()}: {path} (on several "
                     "nodes, serve and train from a data folder every node mounts at the same "
                     "path)")
        return self._cached(self._pixels, path, lambda: Image.open(path).convert("RGB"))

    def expand(self, path):
        """Token ids of one image in a chat turn: the processor's expansion of the placeholder
        (cached per file)."""
        def make():
            out = self.proc(text=self.placeholder, images=[self.image(path)],
                            add_special_tokens=False)
            return list(out["input_ids"][0])
        return self._cached(self._expanded, path, make)

    def _cached(self, cache, key, make):
        """cache[key], made by make() when missing; the least recently used entry goes past CACHE
        entries."""
        if key in cache:
            cache.move_to_end(key)
        else:
            cache[key] = make()
            if len(cache) > self.CACHE:
                cache.popitem(last=False)
        return cache[key]

    def collapse(self, ids, images):
        """(ids with each image's expansion replaced by the bare placeholder, the pictures in
        order): vLLM's input."""
        out, pics, at = [], [], 0
        for start, n, path in sorted(images):
            out += ids[at:start] + self.placeholder_ids
            pics.append(self.image(path))
            at = start + n
        return out + ids[at:], pics

    def pixels(self, rows, device, ids=None, always=False):
        """Model inputs (pixel_values, and pixel_attention_mask or image_grid_thw, ...) of the
        pictures of a batch, rows: per sequence its images [[start, n, path]]
        (Transcript.images); {} when no row has one. A multimodal-RoPE model also gets
        mm_token_type_ids (1 at image tokens) of the batch's ids [B, T].
        always (training, any world size): a batch without pictures gets {"dummy": one white
        picture's inputs} instead, which trainutil.selected_logits runs through the vision tower
        with weight 0. The vision blocks are FSDP units and the model runs them only when it has
        pixels, so without it a rank whose batch has no picture would skip the all-gathers that
        another rank's batch with pictures enters (gloo errors, NCCL hangs)."""
        if not any(rows):
            return {"dummy": self.dummy(device)} if always else {}
        out = self.proc.image_processor([[self.image(p) for *_, p in sorted(r)] for r in rows],
                                        return_tensors="pt")
        if self.mrope:
            out["mm_token_type_ids"] = (ids == self.image_token_id).long()  # [B, T]
        return {k: v.to(device) for k, v in out.items()}

    def dummy(self, device):
        """Pixel inputs of the 224 x 224 white picture (image(None)) alone, as one tile: the least
        vision work."""
        if self._dummy is None:
            ip = self.proc.image_processor
            # Idefics3: no crops
            one_tile = {"do_image_splitting": False} if hasattr(ip, "do_image_splitting") else {}
            self._dummy = ip([[self.image(None)]], return_tensors="pt", **one_tile)
        return {k: v.to(device) for k, v in self._dummy.items()}

def has_vision(model_dir):
    """Whether a model folder's config has a vision tower (a VL policy)."""
    from transformers import AutoConfig
    return hasattr(AutoConfig.from_pretrained(model_dir), "vision_config")

def images_in(images, a, b):
    """The images [[start, n, path]] that lie in ids[a:b], positions made relative to a."""
    return [[s - a, n, p] for s, n, p in images if a <= s and s + n <= b]
