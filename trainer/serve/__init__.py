"""What is done with a trained run: `final/` at the end of `train`, `spotune export` (an adapter copy
or a merged model) and `spotune chat`, each serving what the run trained (its tokenizer, chat
template and the generation config that stops where training ended a turn)."""
