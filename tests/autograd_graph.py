"""Reading a tensor's autograd graph in tests: which operations its backward runs."""

from torch import Tensor


def node_names(t: Tensor) -> set[str]:
    """Names of every autograd node behind `t`."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(n for n, _ in node.next_functions)
    return {node.name() for node in seen}
