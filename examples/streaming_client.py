"""Streaming with the official `openai` client: a chat completion printed as it arrives, and a
completion with usage in the last chunk.

    python examples/streaming_client.py                           # starts a local server
    python examples/streaming_client.py --base-url http://HOST:8000   # uses yours
"""

from __future__ import annotations

import argparse
import contextlib

from local_server import local_server
from openai import OpenAI


def run(base_url: str, api_key: str) -> None:
    client = OpenAI(base_url=base_url + "/v1", api_key=api_key)
    model = client.models.list().data[0].id
    print(f"model: {model}")
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What does os.path.join do?"}],
        max_tokens=48, temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()
    usage = None
    for chunk in client.completions.create(model=model, prompt="def main():", max_tokens=24,
                                           stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.choices:
            print(chunk.choices[0].text, end="", flush=True)
        usage = chunk.usage or usage
    print(f"\nusage: {usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="a running server (default: start one here)")
    parser.add_argument("--api-key", default="unused")
    args = parser.parse_args()
    ctx = (contextlib.nullcontext(args.base_url) if args.base_url
           else local_server("--device", "cpu"))
    with ctx as url:
        run(url, args.api_key)


if __name__ == "__main__":
    main()
