"""The model and its step: loading (base model, quantisation, LoRA), attention over packed
documents, the loss of a micro-batch, the FLOP count, and how the model is spread over devices."""
