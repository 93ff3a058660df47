"""The OpenAI API end to end: the official `openai` SDK (sync and async) and raw httpx
against a real daemon in hybrid mode serving the embedded SmolLM2-135M-Instruct on CPU.

One daemon for the package (conftest.py, package scope: each start loads the model); it
runs with an API key, so every client here sends it, and with a short session length, so
an over-long prompt is cheap to build. Tests that change its state (drain) put it back.
"""
