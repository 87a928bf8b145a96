"""The CUDA kernels' argument structs in the tests: the fields of a C struct in a CUDA source, as
ctypes types (the ctypes mirrors must match them field for field: a mismatch would launch with
garbage), and a kernel library stubbed to record the structs it is passed."""

import ctypes
import re
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "csrc"
_SCALARS = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}


def c_struct_fields(source: str, name: str, nested: dict[str, type] | None = None) -> list[tuple[str, type]]:
    """(field, ctypes type) of ``struct name`` in ``csrc/source``, in order: pointers as c_void_p,
    structs named in ``nested`` as their mirrors."""
    text = (CSRC / source).read_text()
    start = text.index(f"struct {name} {{") + len(f"struct {name} {{")
    body = re.sub(r"//[^\n]*", "", text[start:text.index("};", start)])
    fields = []
    for declaration in filter(None, (d.strip() for d in body.split(";"))):
        match = re.fullmatch(r"(?:const\s+)?(\w+)\s*(\*?)\s*(.+)", declaration, re.S)
        base, pointer, names = match.groups()
        kind = ctypes.c_void_p if pointer else (nested or {}).get(base) or _SCALARS[base]
        fields += [(field.strip(), kind) for field in names.split(",")]
    return fields


def stub_launches(monkeypatch, module, record) -> list:
    """``module``'s (cuda_decode's, cuda_write's) kernel replaced by one that passes each launch's
    argument struct to ``record``, the current stream by 7, and its plans by a fresh cache; returns
    the list that each new plan's arguments are appended to."""
    from vllm_kvcompress.launch_plans import LaunchPlans
    from vllm_kvcompress.triton_kernels import launch
    plans, planned = [], module._plan
    monkeypatch.setattr(module, "_kernel", record)
    monkeypatch.setattr(launch, "stream_handle", lambda device: 7)
    monkeypatch.setattr(module, "_plans", LaunchPlans())
    monkeypatch.setattr(module, "_plan", lambda *args: plans.append(args) or planned(*args))
    return plans
