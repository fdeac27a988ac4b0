"""The engine runtime: requests, scheduling (over ``engine.kv_cache``'s page tables), sampling, the model runner,
the step loop.

Data flows one way each step: ``Scheduler.schedule()`` decides which requests advance by how many
tokens (a ``SchedulerOutput``), ``ModelRunner.execute()`` runs the encoder and the model on exactly
that and samples, and ``Scheduler.update()`` turns the sampled tokens into per-request outputs.
``EngineCore`` owns the loop; nothing here knows about gRPC.
"""
