"""Text <-> token ids for the gateway: the model's tokenizer and chat template, incremental
detokenization and stop-string matching."""
