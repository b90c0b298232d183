"""The kernel tests' bare imports (`import nft_loss`, `import renyi`, `from aot import ...`) name
the modules the project loads (recast_kernels.nft_loss, ...), so that no kernel file is loaded
twice in one pytest process: a second load registers its torch.library operators
(recast::nft_loss_forward, ...) again, after which the first module's fail when traced. A test
copied with its kernel into another project needs none of this (its bare import is the only one).
"""

import importlib
import sys

for _name in ("aot", "nft_loss", "renyi"):
    sys.modules.setdefault(_name, importlib.import_module(f"recast_kernels.{_name}"))
