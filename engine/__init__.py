"""The model executor both node roles share: config, sequences, block manager,
KV pool, models, weights, sampler, scheduler, runner and the offline `Engine`
(`engine.engine.Engine`)."""
