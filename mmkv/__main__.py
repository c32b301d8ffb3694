"""``python -m mmkv serve ...``"""

from mmkv.cli import main

main()
