"""The bundled tiny task: arithmetic problems, the tiny model's tokenizer, constitutions."""
