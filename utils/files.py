"""Saying why a file cannot be read, from its bytes alone (nothing in it is ever unpickled)."""

from __future__ import annotations

import json
from pathlib import Path


def why_unreadable(path: Path, error: Exception) -> str:
    """Why safetensors could not read `path`, told from its bytes (read as bytes: nothing in it is unpickled)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8 + 100_000)  # a safetensors file: its JSON header's length (8 bytes), the header, the data
    if size == 0:
        return "it is empty (0 bytes): save it again, or copy it again if it was still being written"
    if size < 9:
        return f"it has only {size} bytes, fewer than a safetensors header: it is truncated; save or copy it again"
    if head[8:9] == b"{":  # the start of a safetensors header, so the file was cut short or damaged
        length = int.from_bytes(head[:8], "little")
        if 8 + length > size:
            return (f"it is truncated (its header alone should take {8 + length:,} bytes, and the file has {size:,}): "
                    "save or copy it again")
        try:
            entries = json.loads(head[8:8 + length]).values()
            end = 8 + length + max((e["data_offsets"][1] for e in entries if "data_offsets" in e), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            end = size  # a header we cannot read either: say what safetensors said
        if end > size:
            return (f"it is truncated (its header says the file has {end:,} bytes; it has {size:,}): save or copy "
                    "it again")
        return f"it is damaged (safetensors says: {error}): save or copy it again"
    torch_save = head.startswith(b"PK\x03\x04") and b".pkl" in head  # a zip archive holding a pickle
    if torch_save or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")):  # or a bare pickle
        return ("it was written by torch.save (or pickle), and a pickle can run code when loaded. If you trust where "
                "it came from, convert it once: save_file(torch.load(open(path, 'rb'), weights_only=True), new_path, "
                "metadata={'rank': ..., 'alpha': ...}), or load a file written by save_adapter")
    if head.startswith(b"PK\x03\x04"):
        return "it is a zip archive: unzip it, and load the .safetensors file inside"
    return ("it does not start with a safetensors header (random bytes, or another format): load a file written by "
            "save_adapter")
