"""tpujob: your own JAX training loop, protected by the tpujob operator.

::

    import tpujob

    run = tpujob.start()                          # the operator's env, jax.distributed, storage probe
    state = run.restore(state, data_iterator)     # the committed step to continue from, data position too
    for step in range(run.first_step, run.final_step):
        state, metrics = train_step(state, next(data_iterator))
        run.step_done(step + 1, state, data_iterator, loss=metrics["loss"])  # saves when due, reports
        if run.should_stop(step + 1):             # SIGTERM: every process stops here, its save made
            break
    run.finish(state, data_iterator)              # final save and commit; exit 143 after a stop

The guide: docs/guides/own-loop.md. The contract kept with the operator: trainer_image/README.md.
The modules below the API (attempt, checkpointing, local_tier, ...) are what the built-in trainer
(tpujob_trainer) is made of.
"""

from tpujob._run import Run, start
from tpujob.data import StepBatches

__all__ = ["Run", "StepBatches", "start"]
__version__ = "0.1.0"
