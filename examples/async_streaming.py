"""Streaming from a running server with the asyncio client, several requests at
once (start one with `make run`).

    .venv/bin/python examples/async_streaming.py [127.0.0.1:50051]
"""
import asyncio
import sys

from llmserve.client import AsyncClient


async def stream(client: AsyncClient, question: str) -> str:
    parts = []
    async for chunk in client.generate(chat=[{"role": "user", "content": question}],
                                       max_tokens=48, temperature=0):
        parts.append(chunk.text)
    return "".join(parts)


async def main(address: str) -> None:
    questions = ["What is the capital of France?", "Name a primary color.",
                 "What is 3 times 4?"]
    async with AsyncClient(address) as client:
        answers = await asyncio.gather(*(stream(client, q) for q in questions))
    for question, answer in zip(questions, answers):
        print(f"Q: {question}\nA: {answer}\n")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051"))
