"""vagent: train vision-language models to think with images and videos."""

__version__ = "0.1.0"
