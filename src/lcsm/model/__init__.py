"""The Hyena LM: plain single-device PyTorch (hyena), its FFT long convolution (fftconv) and titan spec (spec)."""
