"""The Hydra process's side of a job, one module per concern:

- job.py        validate -> dry run or prepare -> launch -> summarise, for one job
- jobdir.py     a job's outcome (summary.json of one that did not complete); earlier checkpoints set aside
- plan.py       the dry run (`dry_run=true`): groups, stages, schedule grid, memory estimate
- search_space.py the layout search's custom_search_space (parallelism.ep for MoE models)
- local.py      the local launch: the torch elastic agent starts world_size ranks on this node
- forkserver.py the server the ranks fork from (stdlib only: run.py starts it before its own imports)
- watchdog.py   the hang watchdog: reads the ranks' flight recorders, ends a stalled job
- diagnosis.py  how the ranks ended: root cause first, then the consequences, in one block
- node.py       one node of a multi-node job (`python -m framework.launch.node`): torchrun's agent,
                the watchdog, and the exit path that writes the job's error.txt / summary.json
                (not imported here: it is a program)

The rank side is framework/train/ (framework/train/worker.py its entry); the launchers here only
read what the ranks leave (and share the stop path, framework/train/signals.py). Nothing is
imported here: an eager import of the launchers (which import the rank side) would close a cycle.
"""
