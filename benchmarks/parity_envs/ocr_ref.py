"""EasyOCR's side of benchmarks/reward_parity.py, run in the ocr venv (ocr.txt: easyocr 1.7.2):
EasyOCR's own `Reader` (English, on the CPU in float32 as it reads on a GPU, nothing downloaded)
reads each of the work folder's images with `readtext` at its defaults, from the weights folder
named in WORK/weights.txt (the files rewards.py reads: EasyOCR checks their md5 itself). The
reads go to WORK/reference.json; reward_parity.py scores them against the prompts' quoted text
with the reward's own formula.

Usage: python ocr_ref.py WORK. WORK holds images/*.png and weights.txt.
"""

import json
import sys
from pathlib import Path

import easyocr

work = Path(sys.argv[1])
reader = easyocr.Reader(
    ["en"], gpu=False, model_storage_directory=(work / "weights.txt").read_text().strip(),
    download_enabled=False, verbose=False,
    quantize=False,  # as on a GPU: on the CPU EasyOCR reads with int8 LSTM and linear layers
)  # fmt: skip
images = sorted((work / "images").glob("*.png"))
reads = ["".join(reader.readtext(str(path), detail=0)) for path in images]
(work / "reference.json").write_text(json.dumps({"reads": reads}))
