"""One rank's side of a run: everything between reading config.yaml and the rank's exit.

- worker.py          entry (`-m framework.worker`): start-up, failure records, exit codes
- trainer.py         the loop over steps: build a runner, evaluate, checkpoint, log
- accumulation.py    the pp = 1 runner: accumulation over micro-batches; DDP, ZeRO or FSDP2
- pipeline_runner.py the pp > 1 runner: one step around the executor; the measured bubble
- evaluate.py        held-out val_loss
- update.py          after the gradients are reduced: overflow, clip, optimizer step, lr index
- loss_scale.py      fp16-mixed's dynamic loss scaler
- flight.py          the flight recorder the launcher's watchdog reads
- signals.py         SIGINT / SIGTERM deferred to a step boundary (Stopped), read by the launcher too
(the master weights and the optimizer's build are framework/optim/)
"""
