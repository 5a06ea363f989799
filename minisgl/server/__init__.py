"""The serving side: request manager, tokenizer/detokenizer, HTTP app."""
