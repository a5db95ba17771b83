"""`colibri convert`: a Hugging Face checkpoint folder -> one `.coli` container (converter.py). The checkpoint
sources (safetensors_reader.py; pre-quantized FP8 and packed ints: source_quant.py, source_packed.py), the
tokenizer import for tiktoken models (tiktoken_bpe.py), activation-calibrated low-bit quantization
(calibrate.py) and exact re-quantization of packed ints (quant_grid.py)."""
