"""model.py: the Megatron VLM (in progress). `python model.py tiny ...` writes a tiny checkpoint."""
import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["tiny"]:
        import tiny
        tiny.main(sys.argv[2:])
