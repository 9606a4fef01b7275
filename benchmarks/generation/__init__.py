"""Generation: greedy decoding through the pipeline's ring, and an LSTM decoder's carried states; imports only
``common``."""
