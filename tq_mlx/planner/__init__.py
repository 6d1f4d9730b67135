"""What a cache holds and will hold: the machine's memory and a model's weights (machine), the bytes of a plan and of
held caches (memory), and the text every command and the app show of them (display)."""
