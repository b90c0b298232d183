"""The `ocr` reward's second reader: PaddleOCR's PP-OCRv6 text detector and recogniser (the
`small` ONNX exports the rapidocr package ships), sha256-checked, run by rapidocr on onnxruntime.

Follows rapidocr 3.10.0 (github.com/RapidAI/RapidOCR: python/rapidocr/main.py's `RapidOCR` at its
config.yaml defaults; the two files and their SHA256 as its default_models.yaml lists them), read
as flow_grpo's OCR reward reads PaddleOCR (github.com/yifan123/flow_grpo, flow_grpo/ocr.py: no
angle classifier, the texts of the lines it keeps joined). flow_grpo's PaddleOCR 2.x loads
PP-OCRv3/v4 English models from the network; this reader runs the PP-OCRv6 pair that rapidocr
ships in its wheel, so nothing is downloaded. Chosen with RECAST_OCR_READER=paddle
(reward_models.load_ocr_reader); benchmarks/ocr_readers.py compares it with ocr_reader.py's.
"""

import hashlib
import os

import torch

# rapidocr 3.10.0's default_models.yaml, onnxruntime → PP-OCRv6: multi_PP-OCRv6_det_small and
# multi_PP-OCRv6_rec_small (the recogniser's characters are in the ONNX file's metadata)
PADDLE_FILES = {"det": "PP-OCRv6_det_small.onnx", "rec": "PP-OCRv6_rec_small.onnx"}
PADDLE_SHA256 = {
    "det": "090f04abcd9d9a7498bc4ebf677e4cb9bdce1fe4197ddb7e529f1ef44e1ff94f",
    "rec": "6f327246b50388f3c176ae304bd95767ea6dc0c9ae92153ef8cbe210b3c14884",
}
PADDLE_FETCH = "pip install rapidocr==3.10.0 onnxruntime==1.32.0 (requirements.txt pins both)"


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def paddle_folder() -> str:
    """The rapidocr package's models folder; a FileNotFoundError naming the fix if rapidocr is
    not installed."""
    try:
        import rapidocr
    except ImportError:
        raise FileNotFoundError(
            f"RECAST_OCR_READER=paddle needs PaddleOCR's models as rapidocr ships them: "
            f"{PADDLE_FETCH}"
        ) from None
    return os.path.join(os.path.dirname(rapidocr.__file__), "models")


def paddle_weights(folder: str) -> dict[str, str]:
    """{"det": path, "rec": path} in `folder`, each file's sha256 checked against the one rapidocr
    publishes for it (PADDLE_SHA256); a FileNotFoundError if one is missing, a ValueError if one
    is not the published file."""
    paths = {}
    for key, name in PADDLE_FILES.items():
        path = paths[key] = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"reward 'ocr' (paddle): {folder!r} has no {name} ({PADDLE_FETCH})"
            )
        got = _sha256(path)
        if got != PADDLE_SHA256[key]:
            raise ValueError(
                f"reward 'ocr' (paddle): {path} has sha256 {got}, not the {PADDLE_SHA256[key]} "
                f"rapidocr 3.10.0 publishes for {name}: another or a damaged file ({PADDLE_FETCH})"
            )
    return paths


class PaddleReader:
    """Reads the text in images as rapidocr does at its defaults, without the angle classifier
    (text rendered upright, as flow_grpo reads it): the detector's text lines, each recognised,
    kept where the recogniser's confidence is at least 0.5, joined top line first, without
    spaces. On the CPU whatever the training device (onnxruntime's CPU build)."""

    def __init__(self, engine):
        self.engine = engine

    def read(self, rgb: torch.Tensor) -> str:
        """The text in one image (3, H, W) uint8."""
        from PIL import Image

        image = Image.fromarray(rgb.permute(1, 2, 0).cpu().numpy(), "RGB")  # rapidocr: to BGR
        return "".join(self.engine(image).txts or ())


def load_reader(device: torch.device, folder: str | None = None) -> PaddleReader:
    """The reader on the detector and recogniser of `folder` (default: the rapidocr package's),
    sha256-checked; `device` is not used (onnxruntime runs on the CPU). An ImportError naming the
    fix if onnxruntime is missing, which rapidocr would only find at the first read."""
    paths = paddle_weights(folder or paddle_folder())
    try:  # rapidocr loads its models at the first read: without onnxruntime, mid-run
        import onnxruntime  # noqa: F401
    except ImportError:
        raise ImportError(
            f"RECAST_OCR_READER=paddle runs PaddleOCR's models on onnxruntime, which does not "
            f"import here: {PADDLE_FETCH}"
        ) from None
    from rapidocr import RapidOCR

    engine = RapidOCR(
        params={
            "Global.log_level": "error",
            "Global.use_cls": False,  # flow_grpo: use_angle_cls=False, cls=False
            "Det.model_path": paths["det"],  # the files given: rapidocr downloads nothing
            "Rec.model_path": paths["rec"],
        }
    )
    return PaddleReader(engine)
