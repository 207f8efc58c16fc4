"""The rules every process must agree on, tensor-free: the engine, the Triton model, the frontend,
the fleet's picker and the clients import them and nothing deeper.

wire.py        the Triton tensors' names and the result types (one form from engine to clients)
errors.py      the engine's refusals and their codes
limits.py      per-request size limits, one table
setting_strings.py  how a setting given as a string is read
paths.py       where files live on the host
block_keys.py  chained block hashes: the prefix cache's keys and the picker's affinity keys
jct.py         the job-completion-time rule the scheduler sorts by and the picker prices with
token_texts.py one token's text, as every process reports it
checkpoint.py  what a checkpoint's config.json says (family, context length), without transformers
tokenizer_file.py  the served model's tokenizer from its tokenizer.json, AutoTokenizer's ids without torch
"""
