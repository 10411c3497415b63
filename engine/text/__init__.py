"""Text in and out, never inside a step: the request processor (validation, chat template,
tokenization, `OutputStream`), incremental detokenization, reasoning and tool-call parsing,
the tools of a chat."""
