"""A process's own memory mappings as /proc/self/smaps shows them."""
from __future__ import annotations


def mapping_of(address: int) -> dict[str, str | int]:
    """The /proc/self/smaps fields of the mapping holding ``address`` (and "path": its file, "" if anonymous)."""
    fields: dict[str, str] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                if fields is not None:
                    return fields
                start, end = (int(v, 16) for v in head[0].split("-"))
                fields = ({"path": head[5] if len(head) > 5 else "", "start": start, "end": end}
                          if start <= address < end else None)
            elif fields is not None:
                fields[head[0].rstrip(":")] = " ".join(head[1:])
    if fields is None:
        raise AssertionError(f"no mapping holds {address:#x}")
    return fields
