"""The smallest OpenAI-SDK agent: one chat completion, answer to a file. Knows nothing of LoongSage.

It reads only `OPENAI_BASE_URL` and `OPENAI_API_KEY` (the SDK's defaults), its task from argv or
`task.txt` and its system prompt from `instructions.txt` when there is one, asks the first model
the server lists, and writes the reply to `answer.txt` (and stdout) for a verifier. `recipes/blackbox.yaml` trains SmolLM2 through it.

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=... python3 chat_agent.py "What is 2+3?"
"""

import sys
from pathlib import Path

from openai import OpenAI


def main() -> None:
    task = " ".join(sys.argv[1:]) or Path("task.txt").read_text().strip()
    system = Path("instructions.txt")
    messages = [{"role": "system", "content": system.read_text()}] if system.exists() else []
    client = OpenAI()
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, messages=[*messages, {"role": "user", "content": task}], max_tokens=64
    )
    answer = reply.choices[0].message.content or ""
    Path("answer.txt").write_text(answer)
    print(answer)


if __name__ == "__main__":
    main()
