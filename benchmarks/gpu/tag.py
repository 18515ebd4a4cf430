"""The results directory name for a GPU: ``gpu_tag("NVIDIA H100 80GB HBM3", 85e9)`` ->
``h100-sxm-80gb``.

Model, form factor and memory, lower-case, so two runs on the same kind of card land in
the same ``benchmarks/results/<tag>/`` whatever the driver calls it. Pure: the caller
reads the name and the memory (``torch.cuda.get_device_properties`` or NVML).
"""

from __future__ import annotations

import re

# Words that name the vendor or the product line, not the card.
NOISE = {"nvidia", "geforce", "tesla", "quadro", "graphics", "gpu"}
# Form factors as the driver spells them, in the tag's spelling.
FORMS = {"sxm": "sxm", "sxm2": "sxm2", "sxm4": "sxm4", "sxm5": "sxm", "pcie": "pcie",
         "nvl": "nvl"}
# Cards whose driver name leaves the form factor out: the H100 "80GB HBM3" and the
# plain H200 are the SXM boards (the PCIe and NVL boards say so in their names).
DEFAULT_FORM = {"h100": "sxm", "h200": "sxm", "b200": "sxm", "gh200": "sxm"}
# Marketed memory sizes in GB. The driver reports a little less than the label
# (an "80GB" H100 shows 79.2 GiB): the nearest label within 8% names the card.
LABELS_GB = (4, 6, 8, 10, 11, 12, 16, 20, 24, 32, 40, 48, 64, 80, 94, 96, 120, 141, 144,
             180, 192, 288)
GIB = 2**30


def memory_label(total_bytes: int) -> int:
    """The marketed size in GB of a card reporting ``total_bytes`` (else GiB rounded)."""
    gib = total_bytes / GIB
    nearest = min(LABELS_GB, key=lambda label: abs(label - gib))
    return nearest if abs(nearest - gib) <= 0.08 * nearest else round(gib)


def gpu_tag(name: str, total_bytes: int | None = None) -> str:
    """A directory-safe tag ``<model>[-<form>]-<N>gb`` for the GPU called ``name``.

    The memory comes from the name when it says it ("A100-SXM4-40GB", "H100 80GB HBM3"),
    else from ``total_bytes``; without either the tag has no size. Memory-type words
    (HBM3, HBM2e) are dropped. A MIG slice ("... MIG 1g.10gb") is tagged by its profile:
    ``h100-sxm-mig-1g-10gb``. Raises ValueError for an empty name.
    """
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]
    if not words:
        raise ValueError(f"GPU name {name!r} has no letters or digits to make a tag from")
    if "mig" in words:
        at = words.index("mig")
        card = gpu_tag(" ".join(words[:at])) if at else "gpu"
        card = re.sub(r"-\d+gb$", "", card)  # the slice's memory replaces the card's
        return "-".join([card, "mig", *words[at + 1:]])
    model: list[str] = []
    form = None
    size = None
    for word in words:
        if word in NOISE or re.fullmatch(r"hbm\d*e?|gddr\d*x?", word):
            continue
        if word in FORMS:
            form = form or FORMS[word]
        elif re.fullmatch(r"\d+gb", word):
            size = size or int(word[:-2])
        else:
            model.append(word)
    if not model:
        model = [w for w in words if w not in NOISE][:1] or words[:1]
    form = form or DEFAULT_FORM.get(model[0])
    if size is None and total_bytes:
        size = memory_label(total_bytes)
    parts = [*model, *([form] if form else []), *([f"{size}gb"] if size else [])]
    return "-".join(parts)
