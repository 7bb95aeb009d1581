"""TRL 1.16's side of every side-by-side benchmark, in one place.

- ``loss_path``: ``trl_update`` (GSPO updates through ``GRPOTrainer``'s own loss path on a given
  batch, generation replaced) and ``trl_figures`` (it as ``learner_gpu.py`` and
  ``learner_moe_gpu.py`` run it);
- ``whole_loop``: ``trl_loop`` (``GRPOTrainer.train()`` with its own generation, for
  ``loop_gpu.py``);
- ``check``: ``python benchmarks/trl_side/check.py`` checks ``trl_update`` against a
  plain-PyTorch reference on a CPU.

TRL is imported only when a function runs: ``bash benchmarks/trl_wheels.sh`` carries its wheel.
"""

from trl_side.loss_path import TrlResult, trl_figures, trl_update
from trl_side.whole_loop import trl_loop

__all__ = ["TrlResult", "trl_figures", "trl_loop", "trl_update"]
