"""The kernels/ folder under the name `recast_kernels`: `from recast_kernels.renyi import ...`.

The name `kernels` belongs to Hugging Face's library (transformers ≥ 5.25 imports it), so kernels/
has no __init__.py: a namespace folder loses to an installed package of that name, and
`import kernels` finds theirs. The project imports its kernel files through this module instead:
a module with a `__path__` is a package, so Python's import system loads kernels/nft_loss.py as
`recast_kernels.nft_loss` (once, like any module) and kernels/renyi.py as `recast_kernels.renyi`.
"""

from pathlib import Path

__path__ = [str(Path(__file__).resolve().with_name("kernels"))]
