"""tq-chat: a Textual chat app that shows the KV memory TurboQuant saves, live."""
