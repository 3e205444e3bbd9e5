"""The served model's weights: presets and their resolution, variants loaded once and shared, the demo's quantized checkpoints, the quantized linear layers, and what a loaded model's linears run."""
