"""The names under which `gb.Bottleneck` holds its tensors, and the holders.

`nn.ParameterDict` and buffer names cannot contain `"."`, and p-net parameter names do, so
every name is escaped: `"%"` becomes `"%25"`, then `"."` becomes `"%2E"` (percent encoding,
reversed by `unescape`). `gparams["free"]["h.0.ln.bias"]` is the parameter
`free["h%2E0%2Eln%2Ebias"]` and the `state_dict` key `"free.h%2E0%2Eln%2Ebias"`.
"""

import re

from torch import Tensor, nn

# Names a top-level parameter or buffer may have that a `ParameterDict` (or `Buffers`)
# already uses for an attribute or method: registering them raises "attribute exists".
_TAKEN = frozenset(dir(nn.ParameterDict)) | {"get"}


def escape(name: str) -> str:
    """`name` as an `nn.Module` attribute: `%` -> `%25`, then `.` -> `%2E`, and the first
    character of a name the holding dict already uses (`keys`, `values`, ...) as `%XX`
    (reversible: every `%` in the result is an escape)."""
    key = name.replace("%", "%25").replace(".", "%2E")
    return f"%{ord(key[0]):02X}{key[1:]}" if key in _TAKEN else key


def unescape(key: str) -> str:
    """Inverse of `escape`."""
    return re.sub("%([0-9A-F]{2})", lambda m: chr(int(m[1], 16)), key)


class Buffers(nn.Module):
    """Tensors held as buffers under escaped names (frozen parameters, the p-net's buffers)."""

    def __init__(self, tensors: dict[str, Tensor], persistent: dict[str, bool]) -> None:
        super().__init__()
        for name, t in tensors.items():
            self.register_buffer(escape(name), t, persistent=persistent[name])

    def get(self, name: str) -> Tensor:
        return self._buffers[escape(name)]


def parameter_dict(tensors: dict[str, Tensor]) -> nn.ParameterDict:
    """Parameters under escaped names, in `tensors`' order (a plain dict would be sorted)."""
    out = nn.ParameterDict()
    for name, t in tensors.items():
        out[escape(name)] = nn.Parameter(t.detach(), requires_grad=True)
    return out
