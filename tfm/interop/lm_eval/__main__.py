"""The harness's command line with the model `tfm` registered (`tfm-lm-eval`, or `python -m
tfm.interop.lm_eval`): `tfm-lm-eval --model tfm --model_args workdir=W --tasks arc_easy`.

With several processes (jax.distributed's environment: TFM_COORDINATOR/TFM_NUM_PROCESSES/
TFM_PROCESS_ID, SLURM, Open MPI, a TPU pod) every process runs this command: process 0 runs the
harness; the others build the same model from --model_args and run the batches it shares.
"""

from __future__ import annotations

import sys

from lm_eval.__main__ import cli_evaluate

from tfm.interop.lm_eval import hosts
from tfm.interop.lm_eval.model import TfmLM
from tfm.parallel.distributed import maybe_initialize


def main() -> None:
    _, num_processes = maybe_initialize(None)
    if num_processes == 1:
        cli_evaluate()
        return
    if hosts.is_leader():
        try:
            cli_evaluate()
        finally:  # also when the harness failed: the others must not wait forever
            hosts.share(hosts.Message(hosts.STOP))
        return
    from lm_eval._cli import HarnessCLI
    from lm_eval.config.evaluate_config import EvaluatorConfig

    settings = EvaluatorConfig.from_cli(HarnessCLI().parse_args())
    if settings.model != "tfm":
        sys.exit(f"tfm-lm-eval: --model {settings.model} runs on one process; --model tfm "
                 "shares its batches with the others")
    model = TfmLM.create_from_arg_obj(settings.model_args or {}, {
        "batch_size": settings.batch_size, "max_batch_size": settings.max_batch_size,
        "device": settings.device})
    model.follow()  # until process 0 says stop (at once for a folder, which it runs alone)


if __name__ == "__main__":
    main()
