"""Data: what the package ships (an offline BERT vocabulary, the tiny text tasks' fixtures) and access to the
Hugging Face hub (`hub`). The lowest layer beside numerics: it imports nothing above it."""

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
