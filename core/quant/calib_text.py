"""Built-in calibration text for the weight quantizers (core.quant.calibrated).

Written for bestiary: a mix of narrative prose, how-to instructions, dialogue, numbers and
tables, code in a few languages, and a chat-style exchange, so the layers see the kinds of
input a small general model meets. It is independent of the evaluation text of
tests/test_quant_smollm2.py (Python standard-library docstrings). The KV cache scales'
shorter text (core.quant.calibrate.BUILTIN_TEXT) is appended.
"""

from __future__ import annotations

from bestiary.core.quant.calibrate import BUILTIN_TEXT

_PARTS = [
    """\
The lighthouse keeper's daughter kept a notebook of every ship that passed the point. She wrote the
name if she could read it through the glass, the colour of the hull, the direction of travel, and the
hour. On stormy nights she wrote nothing at all, because the rain hid the ships and the wind made the
lamp room shake, and her father told her to sit on the stairs where the walls were thickest. Years
later, when the lighthouse was automated and the family moved inland, she found the notebooks in a
box under her bed. There were eleven of them. She counted the entries one winter: four thousand two
hundred and sixty ships, of which nine appeared more than a hundred times. One of those, a grey
coaster called the Margaret Ellen, had passed twice a week for six years and then simply stopped.
She wrote to the harbour office to ask what had become of it. The reply took three months and said
only that the vessel had been sold abroad and renamed. She never learned the new name.
""",
    """\
How to repot a houseplant without killing it

1. Water the plant a day before. Moist roots slide out of the old pot more easily and tear less.
2. Choose a new pot only one size larger, about two to five centimetres wider than the old one.
   A pot that is too large holds water the roots cannot reach, and the soil stays wet and sour.
3. Make sure the pot has a drainage hole. If it does not, drill one or use it as a cover pot.
4. Turn the plant upside down, supporting the base of the stems between your fingers, and tap the
   rim of the pot against the edge of a table until the root ball comes free.
5. Loosen circling roots gently with your fingers. Cut away any that are black, soft or smell bad.
6. Put fresh potting mix in the bottom of the new pot, set the plant at the same depth as before,
   and fill around it, pressing lightly. Do not bury the stems deeper than they were.
7. Water thoroughly and let the excess drain away. Keep the plant out of direct sun for a week.

Most plants need repotting every one to two years. Signs that it is time: roots growing out of the
drainage hole, water running straight through the pot, or growth that has stopped in spring.
""",
    """\
"You're late," said Maria, without looking up from the screen.
"The bus broke down on the bridge. We all had to walk the last two kilometres."
"In this weather?"
"In this weather." Tom hung his coat on the radiator, where it began to steam. "Did I miss anything?"
"The client called. They want the report by Thursday instead of Friday, and they want the charts in
colour, and they want to know why the numbers for March don't add up."
"Do they add up?"
"They do now. Somebody typed 1,240 where they meant 12,400. I fixed it this morning."
"Was it me?"
She finally looked at him. "Does it matter? Make some coffee and help me with the charts."
""",
    """\
The rate at which a cup of tea cools is roughly proportional to the difference between its
temperature and the temperature of the room. If the tea starts at 90 degrees Celsius in a room at
20 degrees, the difference is 70 degrees; after a few minutes it might be 50, then 35, then 25, each
step taking about the same time, because each time the difference shrinks by the same fraction.
This is Newton's law of cooling, and it is written T(t) = T_room + (T_0 - T_room) * exp(-k t), where
k depends on the cup, the lid, the air and how much tea there is. A wide, thin cup has a large
surface for its volume and cools quickly; a thick mug with a lid cools slowly. Adding cold milk at
the start lowers the temperature at once and so slows the cooling that follows, which is why tea
with milk added early and tea with milk added late end up at different temperatures after ten
minutes, even though the same amount of milk went into both.
""",
    """\
use std::collections::HashMap;

/// Counts how often each word occurs in `text`, ignoring case and punctuation.
fn word_counts(text: &str) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for word in text.split_whitespace() {
        let cleaned: String = word
            .chars()
            .filter(|c| c.is_alphanumeric())
            .flat_map(|c| c.to_lowercase())
            .collect();
        if !cleaned.is_empty() {
            *counts.entry(cleaned).or_insert(0) += 1;
        }
    }
    counts
}

fn main() {
    let text = "The cat sat on the mat. The mat was flat.";
    let mut pairs: Vec<_> = word_counts(text).into_iter().collect();
    pairs.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    for (word, count) in pairs.iter().take(3) {
        println!("{word}: {count}");
    }
}
""",
    """\
SELECT c.name, COUNT(o.id) AS orders, SUM(o.total) AS revenue
FROM customers AS c
JOIN orders AS o ON o.customer_id = c.id
WHERE o.created_at >= DATE '2023-01-01'
GROUP BY c.name
HAVING COUNT(o.id) > 5
ORDER BY revenue DESC
LIMIT 10;
""",
    """\
function debounce(fn, delayMs) {
  let timer = null;
  return function (...args) {
    clearTimeout(timer);
    timer = setTimeout(() => fn.apply(this, args), delayMs);
  };
}

const search = debounce((query) => {
  fetch(`/api/search?q=${encodeURIComponent(query)}`)
    .then((response) => response.json())
    .then((results) => render(results))
    .catch((error) => console.error("search failed:", error));
}, 300);

document.querySelector("#search").addEventListener("input", (event) => search(event.target.value));
""",
    """\
class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, quantity=1, price=0.0):
        if quantity <= 0:
            raise ValueError(f"quantity must be positive, got {quantity}")
        entry = self.items.setdefault(name, {"quantity": 0, "price": price})
        entry["quantity"] += quantity
        entry["price"] = price or entry["price"]

    def remove(self, name, quantity=1):
        entry = self.items.get(name)
        if entry is None or entry["quantity"] < quantity:
            return False
        entry["quantity"] -= quantity
        if entry["quantity"] == 0:
            del self.items[name]
        return True

    def value(self):
        return sum(e["quantity"] * e["price"] for e in self.items.values())


stock = Inventory()
stock.add("apples", 12, 0.4)
stock.add("pears", 5, 0.55)
stock.remove("apples", 3)
print(f"{len(stock.items)} kinds, worth {stock.value():.2f}")
""",
    """\
<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
Can you explain the difference between weather and climate in two sentences?<|im_end|>
<|im_start|>assistant
Weather is the state of the atmosphere at a particular place and time: today's rain, tomorrow's
wind. Climate is the pattern of weather over many years, such as how warm and wet a region usually
is in each season.<|im_end|>
<|im_start|>user
Write a haiku about a train at night.<|im_end|>
<|im_start|>assistant
Lit windows passing,
a river of sleeping towns
flows the other way.<|im_end|>
<|im_start|>user
What's 17 times 23?<|im_end|>
<|im_start|>assistant
17 times 23 is 391: 17 times 20 is 340, and 17 times 3 is 51, and 340 plus 51 is 391.<|im_end|>
""",
    """\
Monthly rainfall, in millimetres, at the coastal station and the hill station:

| month     | coast | hills |
|-----------|-------|-------|
| January   | 78    | 142   |
| February  | 61    | 118   |
| March     | 55    | 104   |
| April     | 42    | 87    |
| May       | 38    | 71    |
| June      | 24    | 46    |
| July      | 12    | 31    |
| August    | 19    | 38    |
| September | 41    | 80    |
| October   | 83    | 151   |
| November  | 96    | 177   |
| December  | 88    | 160   |

The hills receive nearly twice as much rain as the coast in every month, because moist air from
the sea cools as it is pushed upward over the slopes and drops its water. The driest month at both
stations is July; the wettest is November.
""",
    """\
Dear Mr Okafor,

Thank you for your letter of 3 May and for the photographs of the damaged shelving. I am sorry that
the order arrived in this condition. I have spoken to our warehouse, and it appears the boxes were
packed without corner protection, which we normally use for items over twenty kilograms. A
replacement set will be sent on Monday by a different carrier, and you need not return the damaged
parts. I have also refunded the delivery charge of 35 euros to your card; it should appear within
five working days. If anything else is wrong with the new set, please call me directly on the
number below rather than the general line, and I will deal with it myself.

Yours sincerely,
Helen Park
Customer Service Manager
""",
    """\
{
  "id": "a41f9c",
  "created": "2024-03-18T09:42:17Z",
  "status": "shipped",
  "customer": {"name": "Jun Tanaka", "email": "jun.tanaka@example.com", "country": "JP"},
  "items": [
    {"sku": "KB-204", "description": "mechanical keyboard", "quantity": 1, "unit_price": 89.0},
    {"sku": "MS-011", "description": "wireless mouse", "quantity": 2, "unit_price": 24.5}
  ],
  "total": 138.0,
  "currency": "EUR",
  "tracking": null
}
""",
    """\
The first bicycles had no pedals at all. Riders sat on a wooden frame between two wheels and pushed
themselves along with their feet, a design called the running machine, invented in 1817. Pedals
attached directly to the front wheel came in the 1860s, and because one turn of the pedals meant
one turn of the wheel, makers built front wheels as large as a rider's legs could reach, some of
them a metre and a half across. These high-wheelers were fast but dangerous: a stone in the road
could throw the rider over the handlebars head first. The safety bicycle of the 1880s solved the
problem with a chain that drove the rear wheel through gears, so that both wheels could be the same
modest size. Add the air-filled tyre, patented in 1888, and the basic shape of the bicycle was set.
It has changed surprisingly little since.
""",
    """\
Recipe: lentil soup for four

Ingredients: 250 g red lentils, 1 onion, 2 carrots, 2 cloves of garlic, 1 teaspoon ground cumin,
1 litre vegetable stock, 1 tin of chopped tomatoes, the juice of half a lemon, salt, olive oil.

Chop the onion and carrots into small pieces and soften them in two tablespoons of oil over a
medium heat for about eight minutes. Add the crushed garlic and the cumin and stir for one minute.
Rinse the lentils until the water runs clear, then add them with the stock and the tomatoes. Bring
to the boil, turn the heat down and simmer for twenty to twenty-five minutes, until the lentils
have fallen apart. Blend half of the soup if you like it thicker. Season with salt and the lemon
juice just before serving.
""",
    """\
#include <stdio.h>
#include <stdlib.h>

typedef struct Node {
    int value;
    struct Node *next;
} Node;

static Node *push(Node *head, int value) {
    Node *node = malloc(sizeof *node);
    if (node == NULL) {
        perror("malloc");
        exit(EXIT_FAILURE);
    }
    node->value = value;
    node->next = head;
    return node;
}

static Node *reverse(Node *head) {
    Node *prev = NULL;
    while (head != NULL) {
        Node *next = head->next;
        head->next = prev;
        prev = head;
        head = next;
    }
    return prev;
}

int main(void) {
    Node *list = NULL;
    for (int i = 1; i <= 5; i++) {
        list = push(list, i * i);
    }
    for (Node *n = reverse(list); n != NULL; n = n->next) {
        printf("%d ", n->value);
    }
    printf("\\n");
    return 0;
}
""",
    """\
Meeting notes, infrastructure team, Tuesday

Present: Ana, Bilal, Chen, Dora (notes). Apologies: Erik.
- Backups: the nightly job failed twice last week because the disk on the backup host filled up.
  Chen moved old snapshots to cold storage; 1.8 TB free now. Action: Bilal to add an alert at 80%.
- Certificates: three internal certificates expire on the 14th. Ana will renew them on Monday and
  check that the load balancer picks up the new ones without a restart.
- Upgrade of the database cluster: postponed to next month, after the quarterly reports are run.
- On-call rota: Dora swaps the weekend of the 20th with Chen.
Next meeting: Tuesday at 10:00, same room.
""",
    """\
Why does the moon look bigger near the horizon? It is not closer: if anything it is slightly
farther away when it rises, by roughly the radius of the Earth, because you are looking at it from
the side of the planet rather than from directly underneath. A photograph taken with the same lens
shows the rising moon and the high moon at the same size. The difference is in how the brain judges
size. Near the horizon the moon sits beside trees, roofs and hills whose distance we sense, and the
brain seems to place it beyond them, far away, and so scales it up; overhead there is nothing to
compare it with. Psychologists have argued about the details for more than a century, and the moon
illusion still has no explanation everyone accepts.
""",
    """\
#!/usr/bin/env bash
set -euo pipefail

# Resize every JPEG in the given directory to at most 1600 pixels wide, keeping the originals.
src="${1:?usage: resize.sh DIR}"
out="$src/resized"
mkdir -p "$out"
count=0
for img in "$src"/*.jpg "$src"/*.jpeg; do
  [ -e "$img" ] || continue
  convert "$img" -resize '1600x>' -quality 85 "$out/$(basename "$img")"
  count=$((count + 1))
done
echo "resized $count images into $out"
""",
    """\
In the spring of 1962 the village school had thirty-one pupils, two teachers and one stove. The
younger children sat nearest the stove, and the older ones, who had to walk farthest, often arrived
with wet socks that they hung on a line above it, so that the room smelled of wool all morning.
Lessons began with arithmetic, because the headmistress believed that the mind was sharpest before
ten o'clock, and ended with singing, because she believed nothing could go wrong after a song. When
the school closed in 1978 the last register showed nine names. The building is now a holiday
cottage. Its owners found the hooks for the sock line still in the beam and left them there.
""",
    """\
Frequently asked questions

Q: How long does delivery take?
A: Orders placed before 14:00 on a working day are dispatched the same day. Delivery within the
country usually takes one to three working days; international delivery takes five to ten.

Q: Can I change my order after placing it?
A: Yes, until it is dispatched. Use the link in your confirmation email, or contact us with your
order number.

Q: What if my item arrives damaged?
A: Take a photograph of the item and the packaging and send it to us within fourteen days. We will
send a replacement or refund you, whichever you prefer.

Q: Do you ship to post office boxes?
A: Small parcels, yes. Large items need a street address because the courier must get a signature.
""",
    """\
To estimate the height of a tree without climbing it, walk away from the trunk until the top of the
tree is at an angle of 45 degrees above your eye, which you can check by holding a set square or a
folded sheet of paper at eye level. At that point the height of the tree above your eyes equals your
distance from the trunk. Pace the distance, add the height of your eyes above the ground, and you
have the height of the tree. If the ground slopes, or you cannot get to the right spot, measure the
angle at any distance d instead and compute height = d * tan(angle) + eye height; an angle of 30
degrees gives tan = 0.577, and an angle of 60 degrees gives tan = 1.732.
""",
    """\
package main

import (
\t"fmt"
\t"sort"
\t"strings"
)

type Score struct {
\tName  string
\tPoint int
}

func topScores(scores []Score, n int) []Score {
\tsorted := append([]Score(nil), scores...)
\tsort.Slice(sorted, func(i, j int) bool {
\t\tif sorted[i].Point != sorted[j].Point {
\t\t\treturn sorted[i].Point > sorted[j].Point
\t\t}
\t\treturn sorted[i].Name < sorted[j].Name
\t})
\tif len(sorted) > n {
\t\tsorted = sorted[:n]
\t}
\treturn sorted
}

func main() {
\tscores := []Score{{"ada", 91}, {"bo", 78}, {"cy", 91}, {"di", 64}}
\tfor i, s := range topScores(scores, 3) {
\t\tfmt.Printf("%d. %s %s\\n", i+1, strings.ToUpper(s.Name), fmt.Sprint(s.Point))
\t}
}
""",
    """\
The committee's report, published on Friday, makes twelve recommendations. The most expensive is a
new pumping station on the east bank, estimated at 18 million, which the report says would have
prevented most of the flooding in the lower town last November. It also proposes that new houses in
the flood zone be built with their living space on the first floor, that the council publish river
levels online every fifteen minutes, and that residents be able to borrow sandbags from the fire
station without charge. A spokesperson for the council said it welcomed the report and would
respond in detail within three months. Residents' groups said three months was too long to wait.
""",
    """\
Once upon a time a fox found a bunch of grapes hanging from a vine high on a garden wall. He jumped
for them and missed. He took a run and jumped again, and missed again. He tried from the left and
from the right, from a stone and from a log, until his legs ached and the sun was going down. At
last he sat and looked up at the grapes and said, to nobody in particular, that they were surely
sour, and that he had never really wanted them. Then he trotted home. A sparrow on the wall, who had
watched the whole performance, ate one of the grapes and found it very sweet.
""",
    """\
Keyboard shortcuts worth learning:
- Ctrl+Z undoes the last change, Ctrl+Y or Ctrl+Shift+Z redoes it.
- Ctrl+F finds text on the page; Enter jumps to the next match, Shift+Enter to the previous one.
- Alt+Tab switches between windows; hold Alt and press Tab repeatedly to move along the list.
- Ctrl+Shift+T reopens the browser tab you closed last, and can be pressed again for older ones.
- Windows key+L locks the screen, which is a good habit whenever you leave your desk.
- In most editors, Ctrl+D selects the next occurrence of the selected word, so that you can edit
  several at once.
""",
    """\
Proof that the square root of 2 is irrational. Suppose it were rational, so that sqrt(2) = p / q
with p and q whole numbers that have no common factor. Squaring gives 2 q^2 = p^2, so p^2 is even,
and therefore p is even, say p = 2r. Then 2 q^2 = 4 r^2, so q^2 = 2 r^2, and q^2 is even, so q is
even too. But then p and q share the factor 2, which contradicts the assumption. Hence no such p
and q exist, and sqrt(2) is irrational. The same argument, with 2 replaced by any prime, shows that
the square root of every prime number is irrational.
""",
]

WEIGHT_CALIB_TEXT = "\n".join(_PARTS) + "\n" + BUILTIN_TEXT
