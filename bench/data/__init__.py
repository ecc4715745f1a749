"""The data shipped with the package: an offline BERT vocabulary and the fixtures of the tiny text tasks."""

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
