"""The form `torch.compile` traces for a tile MLP's terms, for tests that hold terms rather
than a stack (the library chooses forms from stacks: `_traced_forms.tile_form`)."""

from torch import Tensor

from gbfunc._spec import Terms
from gbfunc.generate._traced_forms import forward_form


def traced_form(terms: Terms, activation: str, b_t: Tensor | None = None) -> str:
    """`forward_form` of these terms as `torch.compile` traces them (not exported); `b_t`:
    the units-major columns the caller hands the tile MLP, or None."""
    a = terms.a
    return forward_form(
        one_layer=terms.w_hidden is None,
        hidden=a.shape[-1],
        outputs=terms.w_out.shape[-1],
        activation=activation,
        dtype=a.dtype,
        device_type=a.device.type,
        traced=True,
        exporting=False,
        units_major_columns=b_t is not None,
    )
