"""Load a LLaVA directory with transformers alone (no hetero) and answer a question about one of
scikit-image's photographs, greedily: ``python scripts/llava_generate.py outputs/llava_hf [photo]``."""

import sys

import skimage.data
import torch
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration

path = sys.argv[1]
photo = sys.argv[2] if len(sys.argv) > 2 else "chelsea"
model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
processor = AutoProcessor.from_pretrained(path)
messages = [{"role": "user", "content": "<image>\nDescribe the image briefly."}]
prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
inputs = processor(images=Image.fromarray(getattr(skimage.data, photo)()), text=prompt, return_tensors="pt")
with torch.no_grad():
    out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
answer = processor.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
print(f"{photo}: {answer}")
