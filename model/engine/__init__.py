"""Serving and evaluation engines over a loaded model: batched generation, windowed scoring, sampling."""
