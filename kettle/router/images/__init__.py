"""Images in prompts, on the router's side (docs/architecture.md, Images in, text out): where they are in a
prompt (`sources`), reading their bytes (`fetch`), checking them against the limits (`check`) and counting the
image tokens each takes (`tokens`). No torch here: the shard runs the image processor and the vision tower."""
