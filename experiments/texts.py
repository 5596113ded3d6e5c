"""Fixed texts for the experiments (written for this project; varied on purpose: prose, facts,
dialogue, code, instructions, a list, a chat turn), so runs compare on the same tokens."""

PASSAGES = [
    # narrative prose
    "The lighthouse keeper climbed the spiral stairs every evening at six, counting the steps as "
    "his father had taught him. There were one hundred and twelve of them, worn smooth in the "
    "middle by a century of boots. At the top he trimmed the wick, polished the great lens with a "
    "soft cloth, and watched the last fishing boats turn for the harbour. On the night of the "
    "storm, a light appeared far out beyond the reef where no ship should have been. He watched "
    "it for an hour, then went down to wake the village, knowing that nobody would believe him "
    "until morning showed them the broken mast on the rocks.",
    # encyclopedic facts
    "Photosynthesis is the process by which green plants, algae and some bacteria convert light "
    "energy into chemical energy. In plants it takes place mainly in the chloroplasts of leaf "
    "cells, where the pigment chlorophyll absorbs red and blue light. The overall reaction uses "
    "carbon dioxide and water to produce glucose and oxygen. The light-dependent reactions split "
    "water molecules and make ATP and NADPH, while the Calvin cycle uses those molecules to fix "
    "carbon into sugars. Nearly all of the oxygen in the atmosphere of the Earth was produced by "
    "photosynthesis over billions of years.",
    # dialogue
    "\"Are you sure this is the right train?\" Maria asked, looking at the departures board.\n"
    "\"Platform four, the 9:15 to Edinburgh,\" said Tom. \"That's what the ticket says.\"\n"
    "\"The board says the 9:15 leaves from platform seven today.\"\n"
    "\"Then we have about three minutes to get to platform seven.\"\n"
    "They ran, dragging their suitcases over the tiled floor, and reached the doors just as the "
    "guard raised his whistle. Maria fell into a seat, laughing, and said that next time she "
    "would be the one who reads the tickets.",
    # code
    "def merge_sorted(left, right):\n"
    "    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
    "    result = []\n"
    "    i = j = 0\n"
    "    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n"
    "            result.append(left[i])\n"
    "            i += 1\n"
    "        else:\n"
    "            result.append(right[j])\n"
    "            j += 1\n"
    "    result.extend(left[i:])\n"
    "    result.extend(right[j:])\n"
    "    return result\n\n\n"
    "def merge_sort(items):\n"
    "    if len(items) <= 1:\n"
    "        return items\n"
    "    middle = len(items) // 2\n"
    "    return merge_sorted(merge_sort(items[:middle]), merge_sort(items[middle:]))\n",
    # instructions / recipe
    "To make a simple loaf of bread, mix five hundred grams of strong white flour with ten grams "
    "of salt and seven grams of dried yeast in a large bowl. Add three hundred and twenty "
    "millilitres of warm water and stir until a rough dough forms. Knead it on a floured surface "
    "for ten minutes, until it is smooth and springs back when pressed. Leave it covered in a "
    "warm place for an hour, until it has doubled in size. Shape it into a loaf, let it rise for "
    "another forty minutes, then bake at two hundred and twenty degrees for about thirty minutes.",
    # list / structured text
    "Packing list for a weekend hiking trip:\n"
    "1. A waterproof jacket and spare socks\n"
    "2. A map of the area and a compass\n"
    "3. Two litres of water per person per day\n"
    "4. Food that does not need cooking: nuts, bread, cheese and fruit\n"
    "5. A small first aid kit with plasters and painkillers\n"
    "6. A head torch with fresh batteries\n"
    "7. Sun cream, even if the forecast is cloudy\n"
    "Check the weather the evening before, tell someone where you are going, and turn back if "
    "the path becomes unsafe.",
    # chat turn (ChatML, as SmolLM2-Instruct is trained on)
    "<|im_start|>user\nWhat are three good habits for learning a new language?<|im_end|>\n"
    "<|im_start|>assistant\nHere are three habits that help most learners. First, practise a "
    "little every day rather than a lot once a week, because regular review keeps new words in "
    "memory. Second, listen to the language as much as you can, through podcasts, films or music, "
    "so that your ear gets used to its sounds and rhythm. Third, speak from the start, even if "
    "you make mistakes: a conversation partner or a tutor will correct you and help you build "
    "confidence.<|im_end|>\n",
    # history / argument
    "The printing press, developed in Europe by Johannes Gutenberg around 1440, changed how "
    "knowledge spread. Before it, books were copied by hand, which made them rare and expensive. "
    "Movable metal type allowed printers to produce hundreds of identical pages in a day. Within "
    "fifty years presses were working in more than two hundred cities, and millions of books had "
    "been printed. Cheaper books encouraged more people to learn to read, helped scientists share "
    "their results accurately, and made it harder for any single authority to control which ideas "
    "were published.",
]

# a short plain-text prompt, so that without a KV cache the context grows several-fold over
# even 50 tokens
STORY_PROMPT = "The old lighthouse keeper found a message in a bottle. It said:"
