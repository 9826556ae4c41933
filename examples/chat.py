"""A terminal chatbot: ``python examples/chat.py`` (the same as ``python -m engine chat``).

Replies stream in the model's chat template; each turn resumes the previous turn's KV state
instead of re-reading the conversation, and prints its time to first token next to a cold
start's. ``/save FILE`` and ``/load FILE`` keep a conversation across processes. The loop
itself is ``engine.chat.ChatSession``: a small class worth reading.
"""

import sys

from engine.cli import main

if __name__ == "__main__":
    sys.exit(main(["chat", *sys.argv[1:]]))
