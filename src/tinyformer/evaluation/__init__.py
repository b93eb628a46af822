"""Evaluation: how well a run's model does on text, chat data and questions (`tinyformer eval`).

    text_loss.py   loss, perplexity and bits per byte on a corpus (--data)    needs torch only
    preference.py  assistant-token loss, preference accuracy (--data .jsonl)  needs torch only
    scoring.py     log p(continuation | context), batched and KV-cached       needs torch only
    tasks.py       offline JSONL tasks and the built-in stdlib task           needs torch only
    reward_scoring.py  mean reward of a run's completions to prompts (--reward)
    harness.py     the lm-evaluation-harness model "tinyformer"               needs the `eval` extra
"""
