"""What torch is doing to the call: whether `torch.export` traces it (the one reading of it
for every torch version), whether dynamo is switched off, and whether transforms nest.

`torch.compiler.is_exporting()` returns the flag `torch.export` sets while it traces. Dynamo up
to torch 2.11 at least (2.13 reads the flag) folds the call to `True` in every graph it traces,
so under `torch.compile` each call looked like an export: no CPU loops or units-major C form in
compiled graphs, and no generated parameter computed into a buffer of its own (`_realised`).
Read directly, the flag is right under both (checked on 2.11 and 2.13: `False` in eager and in
`torch.compile`, `True` in `torch.export.export`, strict and not).
"""

import torch


def exporting() -> bool:
    """Traced by `torch.export` (strict or not), not by `torch.compile`, and not eager."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else bool(flag)


def dynamo_disabled() -> bool:
    """Whether dynamo is switched off (`torch._dynamo.config.disable`, a debugging setting)."""
    return bool(torch._dynamo.config.disable)


@torch.compiler.assume_constant_result
def transforms() -> int:
    """How many `torch.func` transforms wrap the call (`grad` of `vmap`, `jacrev`: 2). Run
    in Python where `torch.compile` traces it: dynamo cannot trace the interpreter stack,
    and folds `peek_interpreter_stack()` to not-None in every graph."""
    stack = torch._C._functorch.get_interpreter_stack()
    return 0 if stack is None else len(stack)
