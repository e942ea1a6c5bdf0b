"""Train KV-eviction gates on a frozen LLM: ``accelerate launch train.py [--config configs/train/X.yaml] [key=value ...]``.

With no argument it runs the quickstart (``configs/train/quickstart.yaml``) on the embedded SmolLM2-135M and the
Paul Graham essays. The run itself reads top to bottom in ``train/run.py``.
"""

import sys

from kvgates.cli import quiet_exits, require_installed

# (wandb and deepspeed, also of the train extra, are asked for only where a config uses them, each in its own sentence)
require_installed("train.py", ("accelerate", "datasets", "trl"))
from train.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(quiet_exits(main, "train.py"))  # Ctrl-C outside the run's own handling, a closed or full stdout: no traceback
