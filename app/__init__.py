"""tq-chat: a Textual chat app that shows the KV memory TurboQuant saves, live. Installed as the package tq_chat
(this folder is app/ in the repository; pyproject.toml maps it)."""
