"""Vision towers and what places their output in a language model's prompt (docs/architecture.md, Images in,
text out): each tower is read from the checkpoint's tensors, as the text families are."""
