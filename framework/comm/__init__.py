"""The collectives a model's layers are built from, and the timer every collective runs
under: below models (which apply tp plans and build MoE layers from them) and below metrics
(whose breakdown reads the timer's spans), so neither reaches up into parallel/.

- comm_timer.py       CommTimer: where a rank waits on communication, per dimension (`timed`,
                      `watch`); the step-time breakdown's source
- tp_comm.py          tp's and sp's autograd collectives (TPComm) and the single-tensor
                      all-gather / reduce-scatter every sharded path uses
- tensor_parallel.py  column / row / vocab-parallel layers and the plans that apply them
- expert_parallel.py  experts over ep: the uneven all-to-all (EPComm), shard specs
- side_thread.py      a pipeline pair's F thread and which group its collectives take
The wrappers of whole models per dimension (dp, ZeRO, FSDP2, cp, pp) are framework/parallel/.
"""
