"""The transformers engines: generate() and continuous batching workers, what one-at-a-time workers share, prefix-KV reuse, decoding options as logits processors."""
