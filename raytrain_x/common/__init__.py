"""Settings, knobs and errors shared by every layer; no Ray and no framework imports here."""
